"""The library inside a training process (`from muster.worker import Worker`): the rank's link to
the coordinator (directly, or through its agent), the reform that aborts a broken process group
and forms the next one in place (`comm`, `backends`, `teardown`), and the training state kept
identical across ranks or recovered from replicas or peer snapshots (`state`, `sharded`,
`snapshots`, `snapshot_ring`, `transfer`)."""
