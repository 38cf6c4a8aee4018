"""The Trainer's pure core: what the coordinator decides and everything it decides with.

The coordinator (rounds, plans, the end of a run; its death chain's verdicts and its rejoins),
ElChe (heterogeneous-speed cadence), the partition planner, policies, epoch metrics, the model
schema, the outer optimizers, the fold barrier (which contribution folds next, when a round is
complete) that the reducer and the relay fold both drive, the round gate (which round a host's
frame belongs to), the plan checks (what a rank may claim about a round: its steps, weight,
tensors and window reports), the fold arithmetic, the rank's schedule policy (plan, report,
contribute, hold, end: the runner in trainer/ only carries it out), and the TrainerSpec every
process agrees on. No asyncio; torch only inside the functions that do tensor math (they run on
executor threads), so the controller can decide without it.

Pure: nothing here imports asyncio or socket.
May import: verdict, errors, wire, control.
"""
