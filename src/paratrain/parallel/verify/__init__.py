"""parallel.verify_plan's shared verdict (verdict.py): the tolerance, the relative error and the one
agreed line that every check of a sharded block against the same block whole uses: tensor/verify.py
(tp), pipeline/verify.py (pp's cuts), context/verify.py (cp's ring), expert/verify.py (ep's dispatch).
"""
