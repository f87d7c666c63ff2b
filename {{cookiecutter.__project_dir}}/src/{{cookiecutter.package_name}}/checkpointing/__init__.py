"""A run's state on disk or in an object store: the Checkpointer the trainer calls to save,
resume and export, atomic verified checkpoints, their names, the choice of the one to resume
and what is kept of them, the run's lock, saves in the background, the best checkpoint, resume
checks and exported weights."""
