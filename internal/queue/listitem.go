package queue

// luaSplitListItem is the Lua function split_item(body), shared by the
// scripts that read a list action's items (the daemon's forward script and
// the client's take script). An item is written by the forward script as
//
//	{"id":<JSON string>,"deadline_ms":<integer>,"payload":<JSON>}
//
// split_item returns id, deadline (a string of digits) and the payload's
// raw JSON text, or nil for a body of another shape. It decodes only the id
// string, never the payload: Redis's cjson refuses JSON nested deeper than
// 1,000 levels, and re-encoding a payload would change its numbers.
//
// The first `,"deadline_ms":` in the body ends the id: inside the encoded
// id every `"` is escaped as `\"`, so the sequence cannot occur there.
const luaSplitListItem = `
local function split_item(body)
  if string.sub(body, 1, 6) ~= '{"id":' then return nil end
  local a, b = string.find(body, ',"deadline_ms":', 7, true)
  if not a then return nil end
  local ok, id = pcall(cjson.decode, string.sub(body, 7, a - 1))
  if not ok or type(id) ~= 'string' then return nil end
  local c, e, d = string.find(body, '^(%d+),"payload":', b + 1)
  if not c or string.sub(body, -1) ~= '}' then return nil end
  return id, d, string.sub(body, e + 1, -2)
end
`
