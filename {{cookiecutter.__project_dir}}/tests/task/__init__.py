"""The guarantees, checked on your task.py: the same global batch trains the same on any world
size and accumulation, resume is bitwise, and faults (signals, crashes, hangs, full disks) end
every rank alike with no checkpoint lost. They train the project's Task: when you change
task.py, these are the tests to keep green."""
