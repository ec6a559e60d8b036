"""Refit: copying the policy's weights into the running generation engine.

``specs`` holds what both sides agree on, ``channels`` the worker-side ends of
the transports, ``sync`` the driver-side orchestration (the core's default
``rlcore_refit``).
"""
