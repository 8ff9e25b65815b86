"""`flashdapo plan`: a launch checked and its memory and step time modelled before the nodes are allocated
(docs/plan.md)."""
