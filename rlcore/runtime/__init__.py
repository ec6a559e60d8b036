"""Runtime helpers backends build on: Ray worker groups, the cluster, batches, processes, the loss."""
