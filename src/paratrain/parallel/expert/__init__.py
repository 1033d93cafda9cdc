"""Expert parallelism (parallel.ep): each mixture-of-experts layer's experts split over ep ranks.

experts.py     which rank computes which experts, and a layer's tokens sent there and back
hf_experts.py  Hugging Face MoE models: their experts modules found, their forward routed there
all_to_all.py  the communication: a differentiable all_to_all_single with split sizes
"""
