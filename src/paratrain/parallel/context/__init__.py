"""Context parallelism (parallel.cp): each sequence split over cp ranks, attention as a ring.

attention.py  the chunk layout, ring attention (forward and backward), the model's hooks
hf.py         Hugging Face decoders hooked from outside: attention, positions, label shift
ring.py       the ring's communication: one tensor passed to the next rank, one taken from the previous
"""
