"""The runtime, in rooms by concern, each importing only those before it in this list
(tests/repo/test_import_layers.py holds it):

- `wrappers`: reading and changing a wrapped model (an adapter per wrapper, FSDP2's private
  reads, the frozen units kept, the idle work of kept units skipped);
- `core`: what one `attach()` holds (`Attachment`, bound models), the counters, the plugin's own
  collectives, the decision line;
- `generating`: forwards without gradients;
- `accumulation`: the window, the hot path per micro-batch;
- `faults`: checkpoints, resume, preemption;
- `uneven_inputs`: `join()` and `step(n)`, ranks with different counts;
- `integration`: binding, and the hooks into Accelerate and the Trainer;

and `handle`, the user's `GradSyncHandle`, over them all. Imports `planning`, `compat`, `config`."""
