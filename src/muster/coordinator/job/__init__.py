"""One job as its leader on this replica runs it: the leader and its tally, the node streams it
reads and writes, what it measures, and its status pages."""
