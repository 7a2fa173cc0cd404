-- Contention: every connection acquires one of HOT keys (argument 3, 10) at
-- random; mostly 409 held. A connection that wins releases at once, so the hot
-- keys keep changing hands.
dofile(debug.getinfo(1, "S").source:match("^@(.*/)") .. "common.lua")

local hot, key, token = 10, nil, nil

function init(args)
   common_init(args)
   hot = tonumber(args[3]) or hot
end

function request()
   if token then
      return post("/services/v1/lease/release", lease_body(key, ',"owner_token":"' .. token .. '"'))
   end
   key = "hot-" .. math.random(0, hot - 1)
   return post("/services/v1/lease", lease_body(key, ',"ttl_seconds":60'))
end

function response(status, headers, body)
   tally(status)
   if token then
      token = nil
   elseif status == 201 then
      token = owner_token(body)
   end
end
