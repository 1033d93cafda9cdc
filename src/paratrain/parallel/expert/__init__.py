"""Expert parallelism (parallel.ep): each mixture-of-experts layer's experts split over ep ranks.

experts.py   which rank computes which experts, and a layer's tokens sent there and back
all_to_all.py  the communication: a differentiable all_to_all_single with split sizes
"""
