"""Gradient compression: how one bucket of gradients is averaged across a group. base.py is the
interface every codec fills; basic.py holds none, bf16, fp16 and top-k and picks a codec by name;
powersgd.py is the low-rank one."""
