"""Checkpoints, resume and preemption: `checkpoint` (a mid-window checkpoint's held gradients
and counters), `plan_checkpoint` (auto's plan in it), `resume` (reading it back) and
`preemption` (`save_on_signal`: the signal, the agreement over ranks, the exit). Imports
`wrappers`, `core`."""
