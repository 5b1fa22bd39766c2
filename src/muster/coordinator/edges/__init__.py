"""The coordinator's edges: the gRPC servicer, the live page over HTTP, and `muster serve`'s assembly of
etcd, a replica and its servers."""
