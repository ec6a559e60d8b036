"""The models rlcore makes and reads: the local tiny model (:mod:`rlcore.models.tiny`) and
the run's tokenizer (:mod:`rlcore.models.tokenizer`)."""
