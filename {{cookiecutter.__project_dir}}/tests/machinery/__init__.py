"""The template's mechanisms tested on their own: configuration, launchers and the nodes'
meeting, storage, the run lock, logs and trackers. They change when the template does."""
