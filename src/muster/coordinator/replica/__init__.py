"""A replica's own machinery: its campaigns for jobs, the runs it reports, the ports its node
streams enter by, and its relays to other replicas' leaders."""
