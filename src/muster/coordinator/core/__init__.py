"""Pure core: policy, rank assignment, liveness and the generation state machine. No I/O."""
