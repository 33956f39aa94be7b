"""The Llama 3 model. `config` is pure Python (the planner reads it); `llama` needs torch."""
