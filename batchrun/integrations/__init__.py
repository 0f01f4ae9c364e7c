"""Entry points for pipelines that already live on another engine (ray_data.py: Ray Datasets).

This layer sits above the job layer and uses its public pieces (prompts, result rows, config); the
job layer never imports it. Its third-party engines are optional extras, imported only when used.
"""
