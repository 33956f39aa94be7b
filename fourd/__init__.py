"""fourd: 4D-parallel training of Llama-style models, and the planner and simulators around it."""

__version__ = "0.1.0"
