"""Every component model.py's tables can name: importing this registers the lectures'
alternatives, RoPE's scalings, the length methods and the attention gate (model.py itself names
none of them)."""

# isort: off
# in this order, which is the order of the choices a message lists
from picollama.components import variants
from picollama.components import rope_scaling
from picollama.components import windowed_rope
from picollama.components import length_encodings
from picollama.components import attention_gate

# isort: on

__all__ = ["attention_gate", "length_encodings", "rope_scaling", "variants", "windowed_rope"]
