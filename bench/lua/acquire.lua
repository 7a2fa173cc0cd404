-- Acquire: every request takes a lease on a fresh key (201 held).
dofile(debug.getinfo(1, "S").source:match("^@(.*/)") .. "common.lua")

local n = 0

function init(args)
   common_init(args)
end

function request()
   n = n + 1
   return post("/services/v1/lease", lease_body("k-" .. id .. "-" .. n, ',"ttl_seconds":60'))
end

function response(status, headers, body)
   tally(status)
end
