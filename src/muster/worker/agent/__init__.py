"""The node agent: `muster run -- torchrun ...` on each node. It holds the node's session with the
coordinator, supervises the node's local ranks (warm starts from a zygote, restarts, drains,
watchdogs, crash reports) and relays their heartbeats. What runs inside the ranks it starts is in
`muster.worker.rank`; the same role inside torchrun is `muster.worker.torchrun`. Nothing here
imports torch at start."""
