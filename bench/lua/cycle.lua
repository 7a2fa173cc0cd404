-- Acquire -> release cycles on a key space of KEYS keys (argument 3, 10,000):
-- acquire a random key; when granted, release it with the owner token; when it
-- is held by another connection (409), draw another key.
dofile(debug.getinfo(1, "S").source:match("^@(.*/)") .. "common.lua")

local keys, key, token = 10000, nil, nil

function init(args)
   common_init(args)
   keys = tonumber(args[3]) or keys
end

function request()
   if token then
      return post("/services/v1/lease/release", lease_body(key, ',"owner_token":"' .. token .. '"'))
   end
   key = "cycle-" .. math.random(0, keys - 1)
   return post("/services/v1/lease", lease_body(key, ',"ttl_seconds":60'))
end

function response(status, headers, body)
   tally(status)
   if token then
      if status == 200 then tally("cycles") end
      token = nil
   elseif status == 201 then
      token = owner_token(body)
   end
end
