"""The node agent: `muster run -- torchrun ...` on each node. It holds the node's session with the
coordinator, supervises the node's local ranks (warm starts from a zygote, restarts, drains,
watchdogs, crash reports) and relays their heartbeats; `rendezvous` is the same role inside
torchrun. The exec wrapper (`runner`), the step probe and the group-end hook run inside the rank
processes the agent starts, for scripts that do not use the library. Nothing here imports torch
at start."""
