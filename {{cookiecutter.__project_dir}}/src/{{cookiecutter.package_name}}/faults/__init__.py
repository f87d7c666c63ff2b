"""Ending well: stop signals, the stop protocol, a launcher that dies, and bounded waits
that name the rank or host they waited for."""
