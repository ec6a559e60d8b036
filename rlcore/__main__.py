from rlcore.app.cli import entrypoint

entrypoint()
