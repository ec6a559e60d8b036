"""The application: ``rlcore run`` (GRPO loop, trace, plots), the CLI and the backend scaffold."""
