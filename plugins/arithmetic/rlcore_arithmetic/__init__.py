"""rlcore-arithmetic: a verifiable arithmetic environment for rlcore."""
