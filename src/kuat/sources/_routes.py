"""How ``Dataset.kuat_fetch_collated`` builds each field of a batch: the route names
``Dataset._collated_routes`` decides once per view, read by the general path
(``kuat.sources.dataset``) and by the one-call fetch that takes some views
(``kuat.sources._rows_fetch``), which must not import each other.

- ``TENSOR``: a tensor field, collated as stored (the gather's ``(B, *shape)`` copy);
- ``NUMBER``: a scalar or bool field, collated as ``torch.tensor`` of Python numbers would be:
  the route's argument is that dtype (int64, float64 or bool);
- ``AS_IS``: a string field, a list of B ``str``;
- ``FILL``: an image field whose fused transform fills one ``(B, 3, H, W)`` buffer, argument
  ``(size, the transform's rows path or None)``;
- ``OTHER``: per sample, then collated (argument: the field's kind).
"""

TENSOR, NUMBER, AS_IS, FILL, OTHER = "tensor", "number", "as is", "fill", "other"
