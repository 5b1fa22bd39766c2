"""How a job's end reads in a node's exit status: `muster run` (and torchrun under the muster
rendezvous backend) exits with the code of its run's outcome. One table for the agent, the backend
and the CLI's help."""

EXIT_SUCCEEDED = 0  # every local rank completed its script (or the run ended succeeded)
EXIT_FAILED = 1  # a slot given up, a rank lost as the job finished, the run failed, refused, evicted, hold expired
EXIT_STOPPED = 3  # an operator stopped the job (Drain.stop, or the run ended stopped) or drained this node

OUTCOMES = {"succeeded": EXIT_SUCCEEDED, "failed": EXIT_FAILED, "stopped": EXIT_STOPPED}

EXIT_STATUS_HELP = f"""exit status:
  {EXIT_SUCCEEDED}      succeeded: every local rank completed its script (a rank that completed, then crashed
         or hung in interpreter teardown, counts as completed), or the run ended succeeded
  {EXIT_FAILED}      failed: a slot was given up, a rank ended without completing as the job finished, the
         run failed, or the coordinator refused or evicted the node, or none answered for --hold-timeout
  2      the command line is wrong
  {EXIT_STOPPED}      stopped: an operator stopped the job (muster stop) or drained this node
  128+N  a signal N drained this node (143 after SIGTERM, 130 after Ctrl-C)"""


def exit_code(outcome: str) -> int:
    """The exit status of a run's outcome (JobEnd.outcome); one not known here is a failure."""
    return OUTCOMES.get(outcome, EXIT_FAILED)
