"""The ranks and the machines they run on: the process group's lifecycle, the agreement
before the first step, and what the network looks like to the other nodes."""
