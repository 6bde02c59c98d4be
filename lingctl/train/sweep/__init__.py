"""Hyper-parameter sweeps over compute budgets, and the scaling laws fitted from them."""
