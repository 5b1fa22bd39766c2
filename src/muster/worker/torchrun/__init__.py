"""What runs inside torchrun: the `muster` rendezvous backend (`--rdzv-backend=muster`)."""
