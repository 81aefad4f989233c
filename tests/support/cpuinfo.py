"""/proc/cpuinfo, read for the fingerprint of the machine a notebook's outputs or a benchmark's results were made on."""


def first_processor(cpuinfo: str) -> dict[str, str]:
  """The fields of the first processor of a /proc/cpuinfo text ('model name', 'flags', ...)."""
  fields = {}
  for line in cpuinfo.split('\n\n')[0].splitlines():
    key, _, value = line.partition(':')
    fields.setdefault(key.strip(), value.strip())
  return fields
