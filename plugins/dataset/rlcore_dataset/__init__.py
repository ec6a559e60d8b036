"""rlcore-dataset: train on a file of prompts with Python reward functions."""
