"""The shipped example's own tests (what it learns, its FLOPs): replace them with your task's."""
