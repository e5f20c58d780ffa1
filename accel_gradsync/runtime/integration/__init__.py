"""Where the runtime meets Accelerate and the Trainer: `bind` (`Binder`: a prepared model
adapted, planned, counted and watched), `hooks` (the per-instance Accelerator and Trainer
subclasses), `callback` (the Trainer's `GradSyncCallback`, `SaveOnSignal`) and `connection`
(what one attach puts in and takes out). Imports every other room."""
