"""The trainer: `fourd train` launches workers (launch.py); each runs the loop in worker.py."""
