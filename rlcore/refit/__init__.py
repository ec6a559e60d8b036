"""Refit: copying the policy's weights into the running generation engine.

``specs`` holds what both sides agree on (tensor specs, bucket plans, channel specs),
``transports`` the transports the core runs (one class each behind
:class:`~rlcore.refit.transports.base.RefitTransport`), ``channels`` a worker's end of
any of them, ``sessions`` the run's open channels, ``sync`` the driver-side
orchestration (the core's default ``rlcore_refit``).
"""
