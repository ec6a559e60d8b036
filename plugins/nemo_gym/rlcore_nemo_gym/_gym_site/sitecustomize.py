# Put on PYTHONPATH of the Gym servers by rlcore-nemo-gym's launcher (never imported
# by rlcore itself). Python loads it at start in every process of the Gym venv
# that has this directory on its path; it acts only in Gym server processes (they
# carry NEMO_GYM_CONFIG_DICT in their environment): it makes them never start or
# join a Ray cluster. Gym would otherwise start its own cluster, or join whichever
# one /tmp/ray/ray_current_cluster names (another run's), for servers that do not
# declare `ray_enabled = False`. The launcher disables Ray in itself directly.
import os

if os.environ.get("NEMO_GYM_CONFIG_DICT") and os.environ.get("RLCORE_GYM_NO_RAY") == "1":
    try:
        import nemo_gym.server_utils as _server_utils

        _server_utils._server_uses_ray = lambda server_class: False
    except Exception as err:  # never break a server's start over this
        print(f"rlcore-nemo-gym sitecustomize: could not disable Ray: {err!r}", flush=True)
