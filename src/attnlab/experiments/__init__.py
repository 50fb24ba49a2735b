"""Many runs at once: sweeps (Optuna studies, shared or local), and comparing finished runs."""
