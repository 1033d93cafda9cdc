"""Expert parallelism (parallel.ep): each mixture-of-experts layer's experts split over ep ranks.

experts.py     which rank computes which experts, and a layer's tokens sent there and back
hf_experts.py  Hugging Face MoE models: their experts modules found, their forward routed there
weights.py     dp's split of the experts' weights: each rank keeps its own; the dense model's export
all_to_all.py  the communication: a differentiable all_to_all_single with split sizes
"""
