"""Everything that plugs into model.py: the alternatives to LLaMA's parts, RoPE's scalings and the
length methods. model.py names none of them. Each leaf only defines its parts. registry.py puts each
one in model.py's tables, and derives the lists of choices from them."""
