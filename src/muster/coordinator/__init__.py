"""The Muster coordinator: etcd-elected leader per job, membership, liveness, rank maps."""
