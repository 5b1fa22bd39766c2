"""What runs in the processes of a rank that `muster run` started: the warm-start zygote that forks
it, the orphan guard between fork and exec, the runner that runs the script, and the hooks it installs
(the step probe, the group end)."""
