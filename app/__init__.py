"""Elastic distributed training on Ray: the ``app.*`` commands and what they share."""

import time

PROCESS_STARTED = time.time()
"""About when the command started: ``python -m app.<command>`` imports this package first,
before torch and the rest (their imports are part of the start a run's timeline counts)."""
