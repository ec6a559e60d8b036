from rlcore.cli import entrypoint

entrypoint()
