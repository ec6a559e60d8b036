"""rlcore-nemo-gym: NeMo Gym environments as rlcore's ``env`` backend (``env.backend: nemo_gym``)."""
