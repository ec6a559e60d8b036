"""Setup: plugins found and checked, the plan made from their declarations, and the plan run."""
