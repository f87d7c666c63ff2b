"""The step and the loop (trainer.py) and what they call: loss normalisation, the
optimizer, the divergence guard, random state."""
