-- The idempotency flow, per connection: acquire a fresh key with a fingerprint
-- (201), complete it with a result (200), then acquire it again as a retry would
-- and get the stored result back (200 completed). Three requests per flow.
dofile(debug.getinfo(1, "S").source:match("^@(.*/)") .. "common.lua")

local n, step, key, token = 0, 0, nil, nil
local fp = ',"fingerprint":"sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08","ttl_seconds":60'

function init(args)
   common_init(args)
end

function request()
   if step == 0 then
      n = n + 1
      key = "order-" .. id .. "-" .. n
      return post("/services/v1/lease", lease_body(key, fp))
   elseif step == 1 then
      return post("/services/v1/lease/complete", lease_body(key,
         ',"owner_token":"' .. token .. '","result":{"charge":"ch_' .. n .. '","amount":4200,"currency":"EUR"}'))
   end
   return post("/services/v1/lease", lease_body(key, fp))
end

function response(status, headers, body)
   tally(status)
   if step == 0 then
      token = status == 201 and owner_token(body) or nil
      step = token and 1 or 0
   elseif step == 1 then
      step = status == 200 and 2 or 0
   else
      if status == 200 and body:find('"status":"completed"', 1, true) then
         tally("flows")
      end
      step = 0
   end
end
