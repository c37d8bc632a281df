"""The safety rules, one module per family of cause (``fx16.analysis.fp32_rules``
composes them; ``fx16.analysis.safety_rule`` states what a rule is)."""
